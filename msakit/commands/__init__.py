"""CLI sub-commands that live outside the module owning their work (each: `add_parser(subparsers)`)."""
