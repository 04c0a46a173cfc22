"""`python -m lucy` runs the same entry point as the `lucy` console script."""

from lucy.cli import main

if __name__ == "__main__":
    main()
