"""Packaging beside pyproject.toml for one thing pyproject cannot say: the tuned configs under ``results/`` ship in the
wheel as the data package ``csa2_lab_results`` (tiles.core.config_store reads them when no source tree is present)."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["lab*", "tiles*", "tuning*", "model*"]), "csa2_lab_results"],
    package_dir={"csa2_lab_results": "results"},
    package_data={"csa2_lab_results": ["*/tuned/*/*.yaml"]},
)
