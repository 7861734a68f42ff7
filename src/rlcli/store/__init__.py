"""The only code that speaks SQL or knows how records are stored."""
