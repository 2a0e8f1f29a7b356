"""``python -m zero3_compile.estimate --model llama-7b --world 4``"""

from . import main

raise SystemExit(main())
