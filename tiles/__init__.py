"""TileLang kernels for the CSA2/CED attention path, each declared through :mod:`tiles.core.contract`."""
