"""``trillm bench``: placeholder replaced below."""
def add_parser(sub): sub.add_parser("bench")
def run_bench(args): raise SystemExit("not yet")
