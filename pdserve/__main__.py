import sys

from pdserve.cli import main

sys.exit(main())
