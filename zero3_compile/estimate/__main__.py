from ..tools.estimate import main

raise SystemExit(main())
