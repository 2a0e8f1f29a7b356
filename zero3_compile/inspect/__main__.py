import sys

from ..tools.inspect.__main__ import main

sys.exit(main())
