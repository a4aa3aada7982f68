"""``python -m nbddp._torchrun``: torchrun as nbddp starts it on each machine (see
``_rank.torchrun``). The name stays short and stable: it is what ``ps`` shows."""

import sys

from ._rank.torchrun import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
