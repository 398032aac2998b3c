from shardc.tools.cli import main

raise SystemExit(main())
