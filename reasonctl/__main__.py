"""``python -m reasonctl`` runs the CLI."""

from reasonctl.cli.app import main

if __name__ == "__main__":
    main()
