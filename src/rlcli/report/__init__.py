"""Reports: queries over the run database, tables, plots and exports."""
