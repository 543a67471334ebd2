"""One module per notebook: what it measures, its quick profile, its tables, figures and comparison rows.

Imports point one way: experiments → pipelines → serving → techniques → runtime → models → foundation. A notebook cell is a
call into its module here and a display; the CLI and the report call the same functions.
"""
