import sys

from normlab.cli import main

sys.exit(main())
