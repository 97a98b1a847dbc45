from guardfl.cli import main; raise SystemExit(main())
