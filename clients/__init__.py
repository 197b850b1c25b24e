"""tokenwire clients and benchmark tools."""
