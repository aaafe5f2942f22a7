"""The end-to-end tests that share one P/D cluster through the store (`served_pd`, this package's
conftest): it starts once for them all and stops after the last of them."""
