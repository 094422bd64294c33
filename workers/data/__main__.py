"""``python -m workers.data prepare SOURCE... --out URL``: see `workers.data.prepare`."""

import sys

from workers.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
