"""Device and link profiles (TOML data shipped with the package) and live power readers.

Kept import-light on purpose: the edge agent starts on small boards, so
``import devices`` loads nothing; import :mod:`devices.profiles` or
:mod:`devices.power` for what you need.
"""
