"""`python -m llm_anatomy.bench URL ...`: the bench subcommand on its own."""

import sys

from .cli import main

sys.exit(main())
