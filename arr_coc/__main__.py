"""`python -m arr_coc <command>`: see `arr_coc.cli`."""

import sys

from arr_coc.cli import main

if __name__ == "__main__":
    sys.exit(main())
