"""A plugin whose import fails, like a vendor plugin on a host without its driver."""

raise ImportError("libfake_driver.so: cannot open shared object file")
