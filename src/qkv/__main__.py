"""``python -m qkv``: the same as the ``qkv`` command."""

from qkv.cli import main

if __name__ == "__main__":  # not when imported (e.g. by pytest --doctest-modules)
    raise SystemExit(main())
