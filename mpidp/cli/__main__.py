from mpidp.cli import main

raise SystemExit(main())
