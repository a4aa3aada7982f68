"""``python -m nbddp._worker``: the command torchrun runs for each rank (see
``_rank.worker``). The name stays short and stable: it is what ``ps`` shows."""

import sys

from ._rank.worker import main

if __name__ == "__main__":
    main(sys.argv[1:])
