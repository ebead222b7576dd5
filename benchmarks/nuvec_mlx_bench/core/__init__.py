"""What every command shares: measuring in rounds (:mod:`.rounds`, no framework; :mod:`.mlx_measure`, MLX's
side), the environment of a run, the command-line values, the throttle, the plots' captions."""
