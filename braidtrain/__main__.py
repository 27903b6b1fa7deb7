from braidtrain.cli import main

raise SystemExit(main())
