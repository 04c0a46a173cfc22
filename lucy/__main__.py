"""`python -m lucy` runs the same entry point as the `lucy` console script."""

from lucy.launch import main

if __name__ == "__main__":
    main()
