"""`python -m server.shards`: the command's entry point; the code is `server.data.shards`."""
import sys

from server.data.shards import main

if __name__ == "__main__":
    sys.exit(main())
