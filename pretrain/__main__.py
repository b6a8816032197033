import sys

from vit.train.signals import hold_ctrl_c

hold_ctrl_c()  # before the imports below: a Ctrl-C during them is held, then ends the run in one line

from pretrain.train import main

sys.exit(main())
