"""`python -m server.enrollment`: the command's entry point; the code is `server.mqtt.enrollment`."""
import sys

from server.mqtt.enrollment import main

if __name__ == "__main__":
    sys.exit(main())
