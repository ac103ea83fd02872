"""``trillm bench``: a load generator against a real server, with baselines measured in the same run."""
