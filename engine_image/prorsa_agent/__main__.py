"""``python -m prorsa_agent ...`` is ``prorsa-agent ...``, for an interpreter without the script."""

import sys

from prorsa_agent.agent_cli import main

sys.exit(main())
