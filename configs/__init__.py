"""The training recipes: `python -m jamp.train --config=<name>` runs `<name>.py` from here.

Written here, at the top of the checkout; installed as `jamp/configs/`.
"""
