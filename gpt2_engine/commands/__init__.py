"""The command line's subcommands, one module each (cli.py assembles them): they sit above every library module and
nothing below imports them."""
