"""The app language: what an app is (its reads, writes and conditions), the
surface it is written against, and its lowering into a per-site program."""
