"""`hps bench`: each measured path beside its floor, through the calls users make."""
