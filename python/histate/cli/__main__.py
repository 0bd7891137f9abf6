"""`python -m histate.cli`: the `histate` command."""
import sys

from histate.cli import main

sys.exit(main())
