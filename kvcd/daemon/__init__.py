"""The long-running side: observe the host, plan, apply, report. Glue between core and host."""
