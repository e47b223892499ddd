from msakit.cli import main

raise SystemExit(main())
