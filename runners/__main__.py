import sys

from rollway.runners.cli import main

sys.exit(main())
