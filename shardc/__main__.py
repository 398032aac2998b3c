from shardc.cli import main

raise SystemExit(main())
