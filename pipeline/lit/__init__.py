"""Lightning modules and trainer construction for the stages that train."""
