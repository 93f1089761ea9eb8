"""`python -m arr_coc_shapes <command>`: see `arr_coc_shapes.cli`."""

import sys

from arr_coc_shapes.cli import main

if __name__ == "__main__":
    sys.exit(main())
