"""``python -m unbroken.cli``: the same as the ``unbroken`` command."""

from unbroken.cli import main

if __name__ == "__main__":
    main()
