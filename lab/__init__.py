"""csa2-lab command line: thin commands that call into model/, tiles/ and tuning/."""
