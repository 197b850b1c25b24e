"""TLS for both ports: flags and their checks, certificate material, SIGHUP reloading."""
