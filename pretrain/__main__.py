import sys

from pretrain.train import main

sys.exit(main())
