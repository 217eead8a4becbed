"""One module per CLI command: ``add_parser(subparsers)`` registers it and sets ``run``
(``parser.set_defaults(run=run)``); ``run(args) -> int`` calls library code and prints.
Shared printing helpers live in :mod:`kvsim.commands._out`."""
