import sys

from finetune.train import main

sys.exit(main())
