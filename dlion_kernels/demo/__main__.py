from .digits import main  # dispatches --task chars to chars.main

main()
