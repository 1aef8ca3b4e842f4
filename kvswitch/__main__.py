from kvswitch.cli import main

raise SystemExit(main())
