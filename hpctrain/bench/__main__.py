import sys

from hpctrain.bench.cli import main

sys.exit(main())
