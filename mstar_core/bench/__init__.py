"""Load generators and benchmark helpers shipped with the CLI."""
