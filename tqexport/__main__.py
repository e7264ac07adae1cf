from tqexport.cli import main

main()
